"""Coverage-guided fuzzing of every decoder that reads bytes from outside (issue #21).

One target per decoder family (``fuzz_*.py``), each with ``test_one_input(data)``
that raises only on a bug; ``run.py`` drives them under atheris (libFuzzer);
``tests/unit/test_fuzz_short.py`` replays the committed inputs and runs each target
for a few seconds in ``make test``. README.md in this directory has the details.
"""
