"""The plugin's configuration error, here so that every layer can raise it: the algorithms
(``metp/``, ``wallfacer/``) check their own shapes, ``validation`` checks the command line."""


class MetpConfigError(ValueError):
    """A configuration the plugin refuses at start-up; the message names the flag and the fix."""
