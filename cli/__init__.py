"""The `edgestream` command line: the top floor, the only place that parses arguments.

One module per command group (``cli.broker``, ``cli.run``, ...); ``cli.main`` builds the
parser from them and owns how a command fails. Nothing below imports this package.
"""
