// Running sums along the rows of x
for (i = 0; i < N; i++)
  for (j = 1; j < M; j++)
    x[i][j] += x[i][j - 1];
