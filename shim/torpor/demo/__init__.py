"""The self-verifying target program that `torpor demo` runs (program.py; stdlib + ctypes only)."""
