"""The back-ends of the commands that check something and judge it (a failed check exits 1):
`ouro verify-resume` (verify_resume.py: a fresh-process resume reproduces the continuous run
bit for bit), `ouro compare` (compare.py: two placements of one job agree within stated
tolerances) and `ouro probe-ucx` (probe_ucx.py: which UCX transports deliver bytes). Their
commands in cli/ parse the options and print the reports."""
