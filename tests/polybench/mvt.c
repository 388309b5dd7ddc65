// PolyBench mvt
for (i = 0; i <= N - 1; i++)
  for (j = 0; j <= N - 1; j++)
    x1[i] = x1[i] + A[i][j] * y_1[j];
for (i = 0; i <= N - 1; i++)
  for (j = 0; j <= N - 1; j++)
    x2[i] = x2[i] + A[j][i] * y_2[j];
