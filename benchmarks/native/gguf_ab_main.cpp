// Old against new GGUF kernel in one process (benchmarks/gguf_ab.py): per layout and token
// count, 9 alternating timings of each, the median (and 2nd-8th of 9) of old time / new time.
// Arguments: N K T... (the weight's rows and columns, the token counts).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <algorithm>
double time_old(int, int, int, int64_t, int64_t);
double time_new(int, int, int, int64_t, int64_t);
int main(int argc, char** argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s N K T...\n", argv[0]);
    return 2;
  }
  const int64_t N = atoll(argv[1]), K = atoll(argv[2]);
  const char* names[] = {"q4_k", "q6_k", "q4_0", "q8_0"};
  for (int li = 0; li < 4; ++li) {
    printf("%s", names[li]);
    for (int i = 3; i < argc; ++i) {
      const int T = atoi(argv[i]);
      std::vector<double> ratio;
      double n_best = 1e9;
      for (int r = 0; r < 9; ++r) {
        double o = time_old(li, T, 2, N, K), n = time_new(li, T, 2, N, K);
        ratio.push_back(o / n);
        n_best = std::min(n_best, n);
      }
      std::sort(ratio.begin(), ratio.end());
      printf(" | T=%d %.2fx (%.2f-%.2f), new %.0f G/s", T, ratio[4], ratio[1], ratio[7],
             double(N) * K * T / n_best / 1e9);
      fflush(stdout);
    }
    printf("\n");
  }
}
