// PolyBench jacobi-1d
for (t = 0; t < T; t++) {
  for (i = 1; i < N - 1; i++)
    B[i] = 0.33333 * (A[i - 1] + A[i] + A[i + 1]);
  for (i = 1; i < N - 1; i++)
    A[i] = 0.33333 * (B[i - 1] + B[i] + B[i + 1]);
}
