"""The pure-Python core: sequences, the block manager and the scheduler. [no torch]"""
