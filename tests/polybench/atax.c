// PolyBench atax: y = A^T (A x); arrays are inferred from their uses.
for (i = 0; i < N; i++)
  y[i] = 0;
for (i = 0; i < M; i++) {
  tmp[i] = 0.0;
  for (j = 0; j < N; j++)
    tmp[i] = tmp[i] + A[i][j] * x[j];
  for (j = 0; j < N; j++)
    y[j] = y[j] + A[i][j] * tmp[i];
}
