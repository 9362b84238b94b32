"""Command-line front ends that tie the layers together (the planner's
questions read this machine's engine defaults): what the libraries below
them must not import."""
