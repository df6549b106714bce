"""The workers the launches run on each rank (one module per family of launches)."""
