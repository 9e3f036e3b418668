// The native kernel alone (moments_core/native/moments.h) against one plain read of the
// same memory: float32 N(1e6, 1) in the layouts of benchmarks/speed.py, one process,
// interleaved, medians.  The read is a 16-lane float32 sum on one thread (what one memory
// pass costs here); the kernel runs with 1 and with `threads` threads.
//
//   g++ -O3 -ffp-contract=off -std=c++17 -march=native -pthread \
//       -Imoments_core/native benchmarks/native_kernel.cc -o /tmp/native_kernel
//   /tmp/native_kernel [threads=2] [reps=21]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "moments.h"

static double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

__attribute__((noinline)) float read_pass(const float* x, int64_t m) {
  float a[16] = {};
  for (int64_t i = 0; i + 16 <= m; i += 16)
    for (int j = 0; j < 16; ++j) a[j] += x[i + j];
  float t = 0;
  for (int j = 0; j < 16; ++j) t += a[j];
  return t;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 2;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 21;
  const stable_moments::Format f{24, -126, 128};
  struct Case {
    int64_t outer, n, inner;
    const char* name;
  } cases[] = {
      {4096, 4096, 1, "[4096,4096] axis 1"},   {1, 4096, 4096, "[4096,4096] axis 0"},
      {1, 131072, 64, "[128,32,32,64] 0,1,2"}, {256, 1024, 1, "[256,1024] axis 1"},
      {4000, 4000, 1, "[4000,4000] axis 1"},   {1, 102400, 64, "[100,32,32,64] 0,1,2"},
  };
  std::vector<float> x(4096 * 4096);
  std::mt19937 g(0);
  std::normal_distribution<float> d(1e6f, 1.0f);
  for (auto& v : x) v = d(g);
  std::vector<float> mean(4096 * 4096), var(4096 * 4096);
  printf("%-22s %10s %10s %10s %9s %9s %10s\n", "case", "read ms", "1 thread", "threads",
         "1t/read", "Nt/read", "undecided");
  for (const Case& c : cases) {
    const int64_t total = c.outer * c.n * c.inner;
    std::vector<double> tr, t1, tn;
    int64_t undecided = 0;
    for (int r = 0; r < reps; ++r) {
      double a = now();
      volatile float s = read_pass(x.data(), total);
      (void)s;
      double b = now();
      stable_moments::moments<float>(x.data(), c.outer, c.n, c.inner, 1, 0, f, mean.data(),
                                     var.data(), 1);
      double e = now();
      undecided = stable_moments::moments<float>(x.data(), c.outer, c.n, c.inner, 1, 0, f,
                                                 mean.data(), var.data(), threads)
                      .undecided;
      double h = now();
      tr.push_back(b - a);
      t1.push_back(e - b);
      tn.push_back(h - e);
    }
    const double r = median(tr), a = median(t1), b = median(tn);
    printf("%-22s %10.3f %10.3f %10.3f %9.2f %9.2f %10lld\n", c.name, r * 1e3, a * 1e3,
           b * 1e3, a / r, b / r, static_cast<long long>(undecided));
  }
}
