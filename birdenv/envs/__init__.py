"""The environments of birdenv."""

from birdenv.envs.critic import BirdCriticEnv

__all__ = ["BirdCriticEnv"]
