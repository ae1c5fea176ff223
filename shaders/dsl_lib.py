"""DSL functions shared by operators; a generated module imports the ones it uses."""
import luisa
from luisa.types import half  # noqa: F401
