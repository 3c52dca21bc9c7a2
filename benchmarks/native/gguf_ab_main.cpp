// Old against new GGUF kernel in one process (benchmarks/gguf_ab.py): per layout and token
// count, 9 alternating timings of each, the median (and 2nd-8th of 9) of old time / new time.
#include <cstdio>
#include <vector>
#include <algorithm>
double time_old(int, int, int); double time_new(int, int, int);
int main() {
  const char* names[] = {"q4_k", "q6_k", "q4_0", "q8_0"};
  const int Ts[] = {1, 4, 5, 8, 9, 16};
  for (int li = 0; li < 4; ++li) {
    printf("%s", names[li]);
    for (int T : Ts) {
      std::vector<double> ratio;
      double n_best = 1e9;
      for (int i = 0; i < 9; ++i) {
        double o = time_old(li, T, 2), n = time_new(li, T, 2);
        ratio.push_back(o / n);
        n_best = std::min(n_best, n);
      }
      std::sort(ratio.begin(), ratio.end());
      printf(" | T=%d %.2fx (%.2f-%.2f), new %.0f G/s", T, ratio[4], ratio[1], ratio[7],
             2048.0 * 1536 * T / n_best / 1e9);
    }
    printf("\n");
  }
}
