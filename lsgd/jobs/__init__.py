"""Training jobs (models and datasets) run by the LSGD/EASGD workers."""
