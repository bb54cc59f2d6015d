"""runlm's kernels without torch: a plain C-ABI library (csrc/native_abi.cpp) built by build.py and
called through ctypes over numpy arrays (kernels.py). Nothing in this package imports torch."""
