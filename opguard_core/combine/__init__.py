"""The combine algebra: the accumulator of callsite traces, the stack table and its C
scanner, and the checks of the ranks an entry's files claim."""
