"""WallFacer: multi-ring sequence-parallel attention, configuration generator, topology scheduler, zigzag."""
