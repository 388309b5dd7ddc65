// A 3x3 "valid" convolution
void conv2d(int H, int W, double img[H][W], double w[3][3], double out[H - 2][W - 2]) {
  for (int o = 0; o < H - 2; o++)
    for (int p = 0; p < W - 2; p++) {
      out[o][p] = 0.0;
      for (int r = 0; r < 3; r++)
        for (int s = 0; s < 3; s++)
          out[o][p] += img[o + r][p + s] * w[r][s];
    }
}
