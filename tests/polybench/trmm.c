// PolyBench trmm: B = alpha * A^T B with A unit lower triangular
double A[M][M], B[M][N];
for (i = 0; i < M; i++)
  for (j = 0; j < N; j++) {
    for (k = i + 1; k < M; k++)
      B[i][j] += A[k][i] * B[k][j];
    B[i][j] = alpha * B[i][j];
  }
