#include "meshtrain/comm/mpi/native.h"

#include <mpi.h>

#include <climits>

#include "meshtrain/comm/mpi/communicator.h"
#include "meshtrain/comm/mpi/internal/mpi_util.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::mpi {

using internal::check;

struct NativeCollectives::Impl {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
};

NativeCollectives::NativeCollectives() : impl_(std::make_unique<Impl>()) {
  initialize();
  check(MPI_Comm_dup(MPI_COMM_WORLD, &impl_->comm), "MPI_Comm_dup", "native");
  MPI_Comm_rank(impl_->comm, &impl_->rank);
  MPI_Comm_size(impl_->comm, &impl_->size);
}

NativeCollectives::~NativeCollectives() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Comm_free(&impl_->comm);
}

int NativeCollectives::rank() const { return impl_->rank; }
int NativeCollectives::size() const { return impl_->size; }

void NativeCollectives::run(CollectiveOp op, const void* send, void* recv, size_t count, DType dtype) {
  if (count > static_cast<size_t>(INT_MAX))
    throw Unsupported("mpi::native", "count above INT_MAX", "split the buffer");
  if (dtype == DType::bf16 || dtype == DType::f16)
    if (op == CollectiveOp::all_reduce || op == CollectiveOp::reduce_scatter)
      throw Unsupported("mpi::native", "MPI has no built-in 16-bit float sum", "use f32");
  const int n = static_cast<int>(count);
  const MPI_Datatype t = internal::mpi_type(dtype);
  MPI_Comm c = impl_->comm;
  switch (op) {
    case CollectiveOp::all_reduce:
      return check(MPI_Allreduce(send == recv ? MPI_IN_PLACE : send, recv, n, t, MPI_SUM, c), "MPI_Allreduce",
                   "native");
    case CollectiveOp::all_gather:
      return check(MPI_Allgather(send, n, t, recv, n, t, c), "MPI_Allgather", "native");
    case CollectiveOp::reduce_scatter:
      return check(MPI_Reduce_scatter_block(send, recv, n, t, MPI_SUM, c), "MPI_Reduce_scatter_block", "native");
    case CollectiveOp::broadcast:
      return check(MPI_Bcast(recv, n, t, 0, c), "MPI_Bcast", "native");
    case CollectiveOp::all_to_all:
      return check(MPI_Alltoall(send, n, t, recv, n, t, c), "MPI_Alltoall", "native");
    default:
      throw Unsupported("mpi::native", "only all_reduce, all_gather, reduce_scatter, broadcast, all_to_all",
                        "use a Communicator for the rest");
  }
}

}  // namespace meshtrain::comm::mpi
