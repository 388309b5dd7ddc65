// PolyBench syrk: C = alpha * A * A^T + beta * C on the lower triangle
for (i = 0; i < N; i++) {
  for (j = 0; j <= i; j++)
    C[i][j] *= beta;
  for (k = 0; k < M; k++)
    for (j = 0; j <= i; j++)
      C[i][j] += alpha * A[i][k] * A[j][k];
}
