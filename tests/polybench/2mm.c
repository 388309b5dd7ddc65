/* PolyBench 2mm: D = alpha * A * B * C + beta * D */
void k2mm(int NI, int NJ, int NK, int NL, double alpha, double beta, double tmp[NI][NJ],
          double A[NI][NK], double B[NK][NJ], double C[NJ][NL], double D[NI][NL]) {
  int i, j, k;
  for (i = 0; i < NI; i++)
    for (j = 0; j < NJ; j++) {
      tmp[i][j] = 0.0;
      for (k = 0; k < NK; ++k)
        tmp[i][j] += alpha * A[i][k] * B[k][j];
    }
  for (i = 0; i < NI; i++)
    for (j = 0; j < NL; j++) {
      D[i][j] *= beta;
      for (k = 0; k < NJ; ++k)
        D[i][j] += tmp[i][k] * C[k][j];
    }
}
