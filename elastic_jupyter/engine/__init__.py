"""Engine-side code: runs inside each ipyparallel engine and imports nothing from Jupyter."""
