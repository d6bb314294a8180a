"""Inspection: ``report`` (one row per matmul, measured errors), ``verify`` (the contract checked on a traced program),
figures."""
