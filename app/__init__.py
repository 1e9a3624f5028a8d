"""The desktop app (PySide6 + pyqtgraph). Only app.engine_worker talks to the engine."""
