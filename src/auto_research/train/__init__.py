"""Training at the generation level: what a run is built from (components.py), the step as phases that hand
frozen values on (experience.py, step.py, update.py), and the run loop around it (loop.py)."""
