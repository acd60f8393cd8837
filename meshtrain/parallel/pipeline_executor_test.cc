// The pipeline executor runs every schedule over real model stages on the
// threads engine and computes what one device computes: a GPT (dropout on)
// cut into 2 or 4 stages (one block each, the embeddings on the first, the
// tied head on the last) on 2 and 4 ranks, GPipe, 1F1B, interleaved (2
// chunks per rank) and ZB-H1, 4 micro-batches: the summed loss and every
// parameter's gradient (wte: its first- and last-stage parts added) equal
// the whole model's accumulated over the same micro-batches, within 1e-6;
// the Saved states alive at once are the schedule's peak (p for 1F1B, m for
// GPipe on rank 0; ZB-H1 keeps r more on rank r until their deferred W).
#include "meshtrain/parallel/pipeline_executor.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "meshtrain/comm/launch.h"
#include "meshtrain/nn/gpt.h"
#include "meshtrain/nn/losses.h"
#include "meshtrain/testing/testing.h"

namespace meshtrain::parallel {
namespace {

constexpr int kMicro = 4, kRows = 2, kT = 8;  // micro-batches of 2 sequences of 8 tokens

nn::GPTConfig base(int layers) {
  return nn::GPTConfig{.vocab = 11, .block_size = kT, .layers = layers, .heads = 2, .width = 8, .seed = 5,
                       .dropout = 0.1};
}

Tensor ids(int mb, bool targets) {
  std::vector<int64_t> v(kRows * kT);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>((i * 7 + mb * 3 + (targets ? 5 : 0)) % 11);
  return targets ? Tensor::from_vector(v, {kRows * kT}) : Tensor::from_vector(v, {kRows, kT});
}

// One GPT part: the embeddings read micro-batch mb's ids, the head's loss
// (cross-entropy / all rows of the step) is kept per micro-batch.
class GptStage final : public PipelineStage {
 public:
  GptStage(int stage, int stages, int layers) : gpt_(part(stage, stages, layers)) {}
  Tensor forward(int mb, const Tensor& input, nn::Saved& saved) override {
    gpt_.set_batch_context(0, mb * kRows);
    const Tensor out = gpt_.forward(gpt_.config().embed ? ids(mb, false) : input, saved);
    if (!gpt_.config().head) return out;
    losses_[mb] = ce_[mb].forward(out, ids(mb, true), kMicro * kRows * kT);
    return Tensor();
  }
  Tensor backward_input(int mb, const Tensor& grad, nn::Saved& saved) override {
    return gpt_.backward_input(gpt_.config().head ? ce_[mb].backward() : grad, saved);
  }
  void backward_weight(int, nn::Saved& saved) override { gpt_.backward_weight(saved); }
  std::vector<int64_t> input_shape(int) const override { return {kRows, kT, 8}; }
  nn::GPT& gpt() { return gpt_; }
  double loss() const {
    double s = 0;
    for (const auto& [mb, l] : losses_) s += l;
    return s;
  }

 private:
  static nn::GPTConfig part(int stage, int stages, int layers) {
    nn::GPTConfig c = base(layers);
    c.first_block = stage * layers / stages;
    c.last_block = (stage + 1) * layers / stages;
    c.embed = stage == 0;
    c.head = stage == stages - 1;
    return c;
  }
  nn::GPT gpt_;
  std::map<int, nn::CrossEntropyLoss> ce_;
  std::map<int, double> losses_;
};

TEST(PipelineExecutor, EverySchedulesGradientsEqualOneDevice) {
  for (int layers : {2, 4}) {
    // The reference: the whole model, the micro-batches one after another.
    nn::GPT whole(base(layers));
    double want_loss = 0;
    for (int mb = 0; mb < kMicro; ++mb) {
      whole.set_batch_context(0, mb * kRows);
      nn::CrossEntropyLoss ce;
      want_loss += ce.forward(whole.forward(ids(mb, false)), ids(mb, true), kMicro * kRows * kT);
      whole.backward(ce.backward());
    }
    std::map<std::string, std::vector<double>> want;
    for (nn::Parameter* p : whole.parameters()) want[p->name] = p->grad.to_vector();
    struct Case {
      ScheduleKind kind;
      int ranks, chunks;
    };
    std::vector<Case> cases;
    for (ScheduleKind k : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zero_bubble})
      cases.push_back({k, layers, 1});
    if (layers == 4) cases.push_back({ScheduleKind::interleaved_1f1b, 2, 2});
    for (const Case& c : cases) {
      const Schedule schedule = make_schedule(c.kind, c.ranks, kMicro, c.chunks);
      const std::string what = fmt::format("{} on {} ranks x {} chunks", to_string(c.kind), c.ranks, c.chunks);
      std::mutex mu;
      std::map<std::string, std::vector<double>> got;
      double loss = 0;
      comm::launch({.engine = comm::Engine::threads, .ranks = c.ranks, .timeout = std::chrono::seconds(30)},
                   [&](comm::Communicator& world) {
                     std::vector<std::unique_ptr<GptStage>> mine;
                     std::map<int, PipelineStage*> stages;
                     for (int s = 0; s < schedule.num_stages(); ++s)
                       if (schedule.stage_rank(s) == world.rank()) {
                         mine.push_back(std::make_unique<GptStage>(s, schedule.num_stages(), layers));
                         stages[s] = mine.back().get();
                       }
                     PipelineExecutor exec(schedule, world, stages);
                     exec.run();
                     // ZB-H1 also holds the state of the r weight passes rank r defers
                     // (a Saved lives until its W).
                     EXPECT_EQ(exec.peak_saved(), peak_in_flight(schedule, world.rank()) +
                                                      (c.kind == ScheduleKind::zero_bubble ? world.rank() : 0))
                         << what;
                     std::lock_guard<std::mutex> lock(mu);
                     for (auto& st : mine) {
                       loss += st->loss();
                       for (nn::Parameter* p : st->gpt().parameters()) {
                         auto& sum = got[p->name];
                         const std::vector<double> g = p->grad.to_vector();
                         if (sum.empty()) sum.assign(g.size(), 0.0);
                         for (size_t i = 0; i < g.size(); ++i) sum[i] += g[i];
                       }
                     }
                   });
      EXPECT_NEAR(loss, want_loss, 1e-9) << what;
      ASSERT_EQ(got.size(), want.size()) << what;
      for (const auto& [name, w] : want) {
        const std::vector<double>& g = got[name];
        ASSERT_EQ(g.size(), w.size()) << what << " " << name;
        for (size_t i = 0; i < w.size(); ++i) ASSERT_NEAR(g[i], w[i], 1e-6) << what << " " << name << " " << i;
      }
    }
  }
}

// A stage that stalls (or throws) in the middle of a 1F1B step: the other
// rank, waiting in a receive, fails within 2x the communicator's deadline
// with an error naming the rank; nothing hangs.
constexpr auto kDeadline = std::chrono::milliseconds(400);

TEST(PipelineExecutor, AStalledOrFailedRankIsNamedWithinTwiceTheDeadline) {
  using Clock = std::chrono::steady_clock;
  class Faulty final : public PipelineStage {
   public:
    Faulty(int stage, bool throws) : inner_(stage, 2, 2), stage_(stage), throws_(throws) {}
    Tensor forward(int mb, const Tensor& input, nn::Saved& saved) override {
      if (stage_ == 1 && mb == 2) {
        if (throws_) throw std::runtime_error("stage 1 broke");
        std::this_thread::sleep_for(3 * kDeadline);
      }
      return inner_.forward(mb, input, saved);
    }
    Tensor backward_input(int mb, const Tensor& g, nn::Saved& s) override { return inner_.backward_input(mb, g, s); }
    void backward_weight(int mb, nn::Saved& s) override { inner_.backward_weight(mb, s); }
    std::vector<int64_t> input_shape(int mb) const override { return inner_.input_shape(mb); }

   private:
    GptStage inner_;
    int stage_;
    bool throws_;
  };
  for (bool throws : {false, true}) {
    const Schedule s = make_schedule(ScheduleKind::one_f_one_b, 2, 4);
    std::string error0;
    Clock::duration took{};
    EXPECT_ANY_THROW(comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = kDeadline},
                                  [&](comm::Communicator& world) {
                                    Faulty stage(world.rank(), throws);
                                    PipelineExecutor exec(s, world, {{world.rank(), &stage}});
                                    const auto t0 = Clock::now();
                                    try {
                                      exec.run();
                                    } catch (const std::exception& e) {
                                      if (world.rank() == 0) error0 = e.what(), took = Clock::now() - t0;
                                      throw;
                                    }
                                  }));
    EXPECT_THAT(error0, ::testing::HasSubstr("rank 1")) << (throws ? "throws" : "stalls");
    fmt::print("{}: rank 0 failed after {} ms: {}\n", throws ? "throws" : "stalls",
               std::chrono::duration_cast<std::chrono::milliseconds>(took).count(), error0);
    EXPECT_LT(took, 2 * kDeadline) << error0;
  }
}

TEST(PipelineExecutor, RefusesStagesTheScheduleDoesNotPlaceHere) {
  const Schedule s = make_schedule(ScheduleKind::one_f_one_b, 2, 2);
  comm::launch({.engine = comm::Engine::threads, .ranks = 2, .timeout = std::chrono::seconds(30)},
               [&](comm::Communicator& world) {
                 GptStage stage(0, 2, 2);
                 EXPECT_THAT(testing::error_of([&] { PipelineExecutor e(s, world, {{1 - world.rank(), &stage}}); }),
                             ::testing::HasSubstr("which the schedule places on rank"));
               });
}

}  // namespace
}  // namespace meshtrain::parallel
