"""Test-only support code shipped with the package (the kill-test harness's fault points)."""
