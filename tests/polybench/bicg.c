// PolyBench bicg: s = A^T r, q = A p
double A[N][M], r[N], s[M], p[M], q[N];
for (int i = 0; i < M; i++)
  s[i] = 0;
for (int i = 0; i < N; i++) {
  q[i] = 0.0;
  for (int j = 0; j < M; j++) {
    s[j] = s[j] + r[i] * A[i][j];
    q[i] = q[i] + A[i][j] * p[j];
  }
}
