"""Learning: the pure learning step (`step.Learner`), the RL losses, sequence packing, the
value head, trainer checkpoints and what XLA says the step needs. Library code: no job
lives here."""
