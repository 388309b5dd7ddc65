/* PolyBench gemm: C = alpha * A * B + beta * C */
void gemm(int NI, int NJ, int NK, double alpha, double beta,
          double C[NI][NJ], double A[NI][NK], double B[NK][NJ]) {
  int i, j, k;
#pragma scop
  for (i = 0; i < NI; i++) {
    for (j = 0; j < NJ; j++)
      C[i][j] *= beta;
    for (k = 0; k < NK; k++) {
      for (j = 0; j < NJ; j++)
        C[i][j] += alpha * A[i][k] * B[k][j];
    }
  }
#pragma endscop
}
