from fedlt.cli import main

main()
