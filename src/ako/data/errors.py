"""The one exception the data package raises for bad input files and arguments."""


class DataError(ValueError):
    """A data file or data argument is unusable.

    The message is a single line that names the offending file or value and says what was
    expected, so the CLI can print it as is and exit with status 2.
    """
