"""learner."""
