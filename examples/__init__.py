"""Example job files (``*.toml``), shipped in the wheel as ``edgestream.examples``.

``edgestream examples`` lists them, ``edgestream examples NAME -o FILE`` writes one out
(``edgestream.job.examples`` finds them in a checkout and in an installed copy).
"""
