"""The one exception type the CLI turns into a single error line and a non-zero exit."""


class MambactlError(Exception):
    """A problem the user can fix: bad input, config, file or device. The message is one line."""


class ShapeError(MambactlError, ValueError):
    """An op got tensors of the wrong shape, dtype or size; raised before anything is dispatched."""
