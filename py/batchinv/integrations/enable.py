def enable():
    raise NotImplementedError
