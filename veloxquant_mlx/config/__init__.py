"""Settings: the only code that reads environment variables and command-line flags."""

from veloxquant_mlx.config.settings import Settings, load_settings

__all__ = ["Settings", "load_settings"]
