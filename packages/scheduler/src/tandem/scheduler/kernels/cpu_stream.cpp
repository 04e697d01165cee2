// The weight stream: a thread that reads a short step's quantized weights from memory
// just ahead of the products that multiply by them, on the core such a step leaves free
// (engine/wiring.py). A decode step of a request or two reads every weight once, over
// the layers' many small products and the head's large one, and one core alone keeps
// too few reads in flight to stream them at the machine's rate; the stream's reads
// bring the next megabytes into the caches the products then find them in.
//
// It changes no result: it only reads, and a product never waits for it. Opened over
// the products in the order a step calls them (models/weight_stream.py), it learns from
// each short product where the step is (weight_reached), reads up to `window` bytes
// ahead of that product's start, from the head on to the first layer's weights for the
// next step, and then waits for the step to move on: spinning a little, then asleep.
// Its thread has Linux's idle priority, so the scheduler thread, the HTTP server and the
// clients on that core run first. Registered as torch.ops.tandem.weight_stream_*.

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_stream.h"

namespace {

constexpr int64_t kLine = 64;           // bytes of a cache line: one read each
constexpr int64_t kPiece = 16 * 1024;   // bytes read between looks at the step's position
constexpr auto kSpin = std::chrono::microseconds(50);  // waiting awake before sleeping

class Stream {
 public:
  // `tensors` in the order the step reads them; `firsts`: the index of each product's
  // codes in `tensors` (its other tensors follow them).
  Stream(at::TensorList tensors, at::IntArrayRef firsts, int64_t window, int64_t rows_below)
      : tensors_(tensors.begin(), tensors.end()), window_(window), rows_below_(rows_below) {
    for (const at::Tensor& t : tensors_) {
      const int64_t bytes = static_cast<int64_t>(t.numel()) * t.element_size();
      pieces_.push_back({static_cast<const uint8_t*>(t.const_data_ptr()), bytes, total_});
      total_ += bytes;
    }
    for (int64_t i : firsts) starts_[tensors_[i].const_data_ptr()] = pieces_[i].begin;
    thread_ = std::thread([this] { run(); });
  }

  ~Stream() { stop(); }

  // Whether a product over the weight whose codes start at `codes` is one of its own.
  bool holds(const void* codes) const { return starts_.count(codes) != 0; }

  void reached(const void* codes, int64_t rows) {
    const auto found = starts_.find(codes);
    if (found == starts_.end()) return;
    if (rows >= rows_below_) {
      long_.fetch_add(1, std::memory_order_relaxed);
      return;
    }
    short_.fetch_add(1, std::memory_order_relaxed);
    if (total_ == 0) return;
    // Positions only grow: a product before the last one starts the next step.
    const int64_t last = position_.load();
    const int64_t cycle = last < 0 ? 0 : last / total_, offset = last < 0 ? -1 : last % total_;
    const int64_t begin = found->second;
    position_.store((begin < offset ? cycle + 1 : cycle) * total_ + begin);
    if (sleeping_.load()) {
      std::lock_guard<std::mutex> lock(mutex_);
      wake_.notify_one();
    }
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  // Cache lines read; products of a short step and of a long one that reached it.
  std::vector<int64_t> stats() const {
    return {lines_.load(std::memory_order_relaxed), short_.load(std::memory_order_relaxed),
            long_.load(std::memory_order_relaxed)};
  }

 private:
  struct Piece {
    const uint8_t* data;
    int64_t bytes;
    int64_t begin;  // its first byte's offset in a step's reads
  };

  void run() {
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "tandem-stream");
    sched_param idle{};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);  // best effort
#endif
    int64_t cursor = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      const int64_t at = position_.load();
      cursor = std::max(cursor, at);
      if (at < 0 || cursor >= at + window_) {
        lock.unlock();
        const auto until = std::chrono::steady_clock::now() + kSpin;
        while (position_.load() == at && std::chrono::steady_clock::now() < until) {
#if defined(__x86_64__)
          for (int i = 0; i < 64; ++i) _mm_pause();
#endif
        }
        lock.lock();
        sleeping_.store(true);
        wake_.wait(lock, [&] { return stopping_ || position_.load() != at; });
        sleeping_.store(false);
        continue;
      }
      const int64_t end = std::min(cursor + kPiece, at + window_);
      lock.unlock();
      read(cursor, end);
      lock.lock();
      cursor = end;
    }
  }

  // Reads one byte a line of the step's bytes [from, to), counted modulo a step.
  void read(int64_t from, int64_t to) {
    uint64_t sum = 0;
    for (int64_t at = from; at < to;) {
      const int64_t offset = at % total_;
      const auto piece = std::prev(std::upper_bound(
          pieces_.begin(), pieces_.end(), offset,
          [](int64_t o, const Piece& p) { return o < p.begin; }));
      const int64_t start = offset - piece->begin;
      const int64_t stop = std::min(piece->bytes, start + (to - at));
      for (int64_t b = start; b < stop; b += kLine) sum += piece->data[b];
      at += stop - start;
    }
    sink_.store(sum, std::memory_order_relaxed);  // the reads are not optimized away
    lines_.fetch_add((to - from + kLine - 1) / kLine, std::memory_order_relaxed);
  }

  std::vector<at::Tensor> tensors_;  // held, so their memory stays while the stream reads
  std::vector<Piece> pieces_;
  std::unordered_map<const void*, int64_t> starts_;  // a product's codes -> its first byte
  int64_t total_ = 0;
  const int64_t window_, rows_below_;
  std::atomic<int64_t> position_{-1};  // the step's: steps * total_ + the product's start
  std::atomic<bool> sleeping_{false};
  std::atomic<int64_t> lines_{0}, short_{0}, long_{0};
  std::atomic<uint64_t> sink_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

// The open streams by handle; a product reports to the last one opened that holds its
// weight, so that two engines in one process (`tandem bench --compare-overlap`) each
// stream their own weights. Never destroyed: a stream left open at exit is not joined
// while the process's statics go.
struct Registry {
  std::mutex mutex;
  std::map<int64_t, std::shared_ptr<Stream>> streams;
  std::atomic<int64_t> open{0};  // streams.size(), read by every product without the lock
  int64_t next = 1;
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

int64_t weight_stream_open(at::TensorList tensors, at::IntArrayRef firsts, int64_t window_bytes,
                           int64_t rows_below) {
  TORCH_CHECK(window_bytes > 0 && rows_below > 0,
              "tandem::weight_stream_open: window_bytes and rows_below must be positive");
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(),
                "tandem::weight_stream_open: the weights must be contiguous CPU tensors");
  }
  for (int64_t i : firsts) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(tensors.size()),
                "tandem::weight_stream_open: a product's first tensor ", i, " is not one of ",
                tensors.size());
  }
  auto stream = std::make_shared<Stream>(tensors, firsts, window_bytes, rows_below);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.streams[r.next] = std::move(stream);
  r.open.store(static_cast<int64_t>(r.streams.size()));
  return r.next++;
}

void weight_stream_close(int64_t handle) {
  std::shared_ptr<Stream> stream;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    const auto found = r.streams.find(handle);
    if (found == r.streams.end()) return;
    stream = std::move(found->second);
    r.streams.erase(found);
    r.open.store(static_cast<int64_t>(r.streams.size()));
  }
  stream->stop();  // a product still holding it finds it stopped
}

std::vector<int64_t> weight_stream_stats(int64_t handle) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto found = r.streams.find(handle);
  TORCH_CHECK(found != r.streams.end(), "tandem::weight_stream_stats: no open stream ", handle);
  return found->second->stats();
}

}  // namespace

namespace tandem_cpu {

void weight_reached(const void* codes, int64_t rows) {
  std::shared_ptr<Stream> stream;
  {
    Registry& r = registry();
    if (r.open.load(std::memory_order_relaxed) == 0) return;  // most processes: no lock
    std::lock_guard<std::mutex> lock(r.mutex);
    for (auto it = r.streams.rbegin(); it != r.streams.rend(); ++it) {
      if (it->second->holds(codes)) {
        stream = it->second;
        break;
      }
    }
  }
  if (stream != nullptr) stream->reached(codes, rows);
}

}  // namespace tandem_cpu

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.def("weight_stream_open(Tensor[] tensors, int[] firsts, int window_bytes, int rows_below) "
        "-> int",
        weight_stream_open);
  m.def("weight_stream_close(int handle) -> ()", weight_stream_close);
  m.def("weight_stream_stats(int handle) -> int[]", weight_stream_stats);
}
