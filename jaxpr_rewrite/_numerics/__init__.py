"""The contract's formulas, exactly: scales held as mantissa and power of two, correctly rounded quotients without the
hardware's division, codes, static scales, the int8 x int8 -> int32 dot with exact sums, float formats and packed
4-bit codes."""
