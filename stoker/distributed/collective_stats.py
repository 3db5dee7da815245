"""placeholder"""
def summarize(tp):
    return None
