"""Training: losses, the learner, rollout schedules and workers, the teacher, evaluation, set-up, the loop."""
