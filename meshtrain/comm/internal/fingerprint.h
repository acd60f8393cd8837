// Fingerprints and abort notices as the MPI and Gloo engines send them
// between ranks, and the MismatchError every rank builds from them. Internal
// to the engines.
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "meshtrain/comm/communicator.h"
#include "meshtrain/core/error.h"

namespace meshtrain::comm::internal {

// "rank 3", "ranks 0-2, 5" (ranks sorted ascending).
std::string format_ranks(const std::vector<int>& ranks);

// A Fingerprint on the wire: fixed 24-byte layout, sent as MPI_BYTE.
struct WireFingerprint {
  uint64_t seq = 0;
  uint64_t count = 0;
  int32_t root = -1;
  uint8_t op = 0, dtype = 0, reduce = 0;
  uint8_t present = 0;  // in a notice's table: 1 if that rank's fingerprint arrived

  static WireFingerprint from(const Fingerprint& f);
  Fingerprint to() const;
};
static_assert(sizeof(WireFingerprint) == 24);

// all_to_all_v's counts travel in the fingerprints: the one a rank sends
// peer p carries send_counts[p] as its count, and p checks it against its
// recv_counts[rank]. Other ops send op.fingerprint() to every peer.
Fingerprint fingerprint_to(const Op& op, int peer);
// Checks `theirs`, what `peer` sent this rank for `op`: throws the
// MismatchError of an all_to_all_v whose counts disagree (naming both
// ranks); returns canonical(theirs), to compare with op.fingerprint().
Fingerprint check_from(const Op& op, int self, int peer, const Fingerprint& theirs);
// f with all_to_all_v's per-peer count cleared (what a mismatch table shows).
Fingerprint canonical(Fingerprint f);

// What every rank called at one sequence number, indexed by rank; nullopt:
// that rank's fingerprint did not arrive.
using FingerprintTable = std::vector<std::optional<Fingerprint>>;

// "rank 0 called all_reduce #5 (f32 x 1000, sum) but ranks 1-3 called
// broadcast #5 (f32 x 1000, root 0)[; ranks that did not arrive: [..]]".
// Groups appear in order of their lowest rank, so every rank builds the same
// sentence from the same table; ranks() are those whose call differs from
// table[self]'s. Precondition: table[self] is present.
MismatchError mismatch_error(const std::string& op, const FingerprintTable& table, int self);

// An error's what() (what a notice's reason carries); "unknown error" for
// an exception that is not a std::exception.
std::string reason_of(const std::exception_ptr& error);

// What a process engine's on_error handler prints before it ends the job:
// flushes stdout, prints "meshtrain: error on rank R: <what>" to stderr, and
// for an AbortedError (a peer failed first) waits half a second so that
// the peer's cause prints first.
void report_rank_error(const std::exception& error, int world_rank);

// What a failing rank tells its peers (tag 0 of the check communicator).
struct Notice {
  // The sending channel's id: OpenMPI reuses a freed communicator's context
  // id, and a notice that arrives after its communicator was freed is
  // delivered to the next communicator with that id.
  uint64_t channel = 0;
  uint64_t seq = 0;          // the collective that failed; 0 if none
  FingerprintTable mismatch; // non-empty iff the failure is a MismatchError
  std::string reason;        // the error's what(), at most 2 KiB
};
std::string encode_notice(const Notice& notice);
// Never throws: a short or garbled message yields a notice with what it could
// read (reason "(unreadable notice)").
Notice decode_notice(std::string_view bytes);

}  // namespace meshtrain::comm::internal
