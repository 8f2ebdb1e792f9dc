from mambactl.cli import main

main()
