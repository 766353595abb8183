from gpumem.cli import console_main

console_main()
