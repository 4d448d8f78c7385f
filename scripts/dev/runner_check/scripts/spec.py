print(__spec__, __loader__, __package__, __doc__, __builtins__.__name__ if hasattr(__builtins__,'__name__') else type(__builtins__))
