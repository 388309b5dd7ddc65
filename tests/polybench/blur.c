// A producer-consumer pair through a local buffer
void blur(int N, double A[N], double C[N]) {
  double B[N];
  for (int i = 0; i < N; i++)
    P: B[i] = A[i] * 2.0 + 1.0;
  for (int j = 1; j < N - 1; j++)
    Q: C[j] = B[j - 1] + B[j] + B[j + 1];
}
