"""The decode-step breakdown lives in the package (minipaged/lab/step_breakdown.py, lesson 15);
this name stays for the benchmarks that import it from here."""
from minipaged.lab.step_breakdown import (cpu_capability_notes, decode_step_breakdown,  # noqa: F401
                                          format_decode_breakdown, matmul_peak_flops)
