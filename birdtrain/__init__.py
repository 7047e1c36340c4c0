"""birdtrain: training small language models as SQL-debugging agents on the birdenv environments."""

__all__: list[str] = []
