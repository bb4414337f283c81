"""`handgrad serve`: engine.py decodes many sequences in batched steps; app.py speaks OpenAI's
protocol over it (Starlette); command.py is the command line; page.html the chat page."""
from .command import add_arguments, main

__all__ = ["add_arguments", "main"]
