"""Triton kernels, each beside a plain-PyTorch reference with the same signature.

Modules are imported on demand (``from speedrun.kernels.polar_express import polar_express``);
this package itself imports nothing heavy.

- ``polar_express``: symmetric GEMMs (XX^T, X^T X, b*A + c*A@A) and the Polar Express
  orthogonalisation used by the NorMuon optimizer.
"""
