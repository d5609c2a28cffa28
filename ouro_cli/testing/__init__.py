"""Test-only support code shipped with the package: fault points, a broken resume, PD worker faults
(faults.py). Nothing here is an option of a command."""
