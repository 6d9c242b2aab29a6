"""A team's own model, as a user would write it: a handler package the workers import."""
